"""Development tools: the embedded Postgres, the local selections service, demo and bench."""
