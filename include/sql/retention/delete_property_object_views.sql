-- Second in FK order. Index ix_property_object_views_session_id. ON DELETE SET NULL on
-- action_events.property_object_view_id finds nothing: this session's events are gone already.
-- property_object_view_stats is never touched (INV-LVS-002).
delete from user_activity.property_object_views
where session_id = any(%(session_ids)s::uuid[])
