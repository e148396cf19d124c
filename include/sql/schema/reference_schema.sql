-- Reference schema of the tables the maintenance DAGs read and write (docs/design.md, "Database schema").
-- The tables belong to the news, calendar and user-activity services; production owners apply
-- their own migrations. This file exists for development, the demo and the tests.
-- Enum-like columns are plain varchar(16) without CHECK constraints on purpose: unknown values
-- can occur in production and the jobs must cope with them.

create schema if not exists news;
create table news.snapshot_detach_outbox (
  id uuid primary key,                  -- UUIDv7
  snapshot_id uuid not null,
  post_id uuid not null,
  reason varchar(16) not null,          -- BlockReplaced | PostDeleted
  attempts integer not null default 0,
  next_attempt_at timestamptz not null,
  status varchar(16) not null default 'Pending',  -- Pending | Done | Quarantined
  last_error varchar(512),
  created_at timestamptz not null,
  updated_at timestamptz not null
);
create unique index ux_sdo_snapshot on news.snapshot_detach_outbox (snapshot_id) where status <> 'Done';
create index ix_sdo_post on news.snapshot_detach_outbox (post_id);
create index ix_sdo_due on news.snapshot_detach_outbox (status, next_attempt_at);

create schema if not exists calendar;
create table calendar.availability_slots (
  id uuid primary key,
  tenant_id uuid not null,
  consultant_id uuid not null,
  start_at timestamptz not null,
  end_at timestamptz not null,
  status varchar(16) not null,          -- Available | Booked | Expired | Archived
  version integer not null default 1,
  created_at timestamptz not null,
  updated_at timestamptz not null
);
create index ix_availability_slots_status_start on calendar.availability_slots (status, start_at);

create schema if not exists user_activity;
create table user_activity.sessions (
  id uuid primary key,
  user_id uuid,
  anonymous_id uuid,
  status varchar(16) not null,          -- Active | Inactive
  started_at timestamptz not null,
  last_activity_at timestamptz not null,
  ended_at timestamptz,                 -- always set when Inactive (INV-SES-005)
  created_at timestamptz not null
);
create index ix_sessions_status_ended_at on user_activity.sessions (status, ended_at);
create table user_activity.property_object_views (
  id uuid primary key,
  session_id uuid not null references user_activity.sessions (id) on delete restrict,
  property_object_id uuid not null,
  apply_filter_event_id uuid,           -- FK to action_events, on delete set null (below)
  started_at timestamptz not null,
  ended_at timestamptz,
  duration_ms bigint
);
create index ix_property_object_views_session_id on user_activity.property_object_views (session_id);
create table user_activity.action_events (
  id uuid primary key,
  session_id uuid not null references user_activity.sessions (id) on delete restrict,
  property_object_view_id uuid references user_activity.property_object_views (id) on delete set null,
  type varchar(64) not null,
  occurred_at timestamptz not null,
  payload jsonb
);
create index ix_action_events_session_id on user_activity.action_events (session_id);
create index ix_action_events_property_object_view_id on user_activity.action_events (property_object_view_id);
alter table user_activity.property_object_views
  add constraint fk_property_object_views_apply_filter_event
  foreign key (apply_filter_event_id) references user_activity.action_events (id) on delete set null;
create index ix_property_object_views_apply_filter_event_id on user_activity.property_object_views (apply_filter_event_id);
create table user_activity.property_object_view_stats (
  property_object_id uuid primary key,
  views_count bigint not null,
  total_duration_ms bigint not null,
  updated_at timestamptz not null
);
