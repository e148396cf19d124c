-- dry_run: property_object_views a batch would delete.
select count(*)
from user_activity.property_object_views
where session_id = any(%(session_ids)s::uuid[])
