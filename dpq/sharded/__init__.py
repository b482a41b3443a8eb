"""The no-grad passes sharded over lanes (``shard``) and over processes (``shard_processes``)."""
