-- Children first (FK RESTRICT on sessions). Index ix_action_events_session_id.
-- ON DELETE SET NULL clears property_object_views.apply_filter_event_id of the same session
-- (index ix_property_object_views_apply_filter_event_id).
delete from user_activity.action_events
where session_id = any(%(session_ids)s::uuid[])
