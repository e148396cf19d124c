-- What the job's own role may do, one row per item asked (include/pin_maintenance/privileges.py):
-- granted is true or false, or null when the object does not exist. Objects are looked up by
-- name in the catalogs and checked by oid: the name forms of has_table_privilege and the like
-- raise "permission denied for schema" when the role lacks USAGE on it, instead of answering.
-- A column privilege is the column's or the table's; any_column is what a row lock needs
-- (UPDATE on at least one column).
select w.item,
       case w.kind
         when 'schema' then has_schema_privilege(n.oid, w.privilege)
         when 'table' then has_table_privilege(c.oid, w.privilege)
         when 'any_column' then has_any_column_privilege(c.oid, w.privilege)
         when 'column' then has_column_privilege(c.oid, a.attnum, w.privilege)
         when 'function' then has_function_privilege(p.oid, w.privilege)
       end as granted,
       current_user::text as role_name
from unnest(%(kinds)s::text[], %(schemas)s::text[], %(names)s::text[], %(columns)s::text[],
            %(privileges)s::text[])
       with ordinality as w (kind, schema_name, object_name, column_name, privilege, item)
left join pg_namespace n on n.nspname = w.schema_name
left join pg_class c
  on w.kind in ('table', 'any_column', 'column')
 and c.relnamespace = n.oid
 and c.relname = w.object_name
left join pg_attribute a
  on w.kind = 'column'
 and a.attrelid = c.oid
 and a.attname = w.column_name
 and a.attnum > 0
 and not a.attisdropped
-- to_regprocedure only for function rows: Postgres may evaluate it for every row of the join,
-- and before 16 it raises on a name without an argument list instead of returning null
left join pg_proc p
  on w.kind = 'function'
 and p.oid = case when w.kind = 'function'
                  then to_regprocedure(w.schema_name || '.' || w.object_name) end
order by w.item
