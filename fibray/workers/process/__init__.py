"""The process boundary: the sandboxed executor that runs candidate code, the launcher that
sandboxes it after exec, the channel and shared-memory arena between it and its supervisor.
Nothing here imports Ray or the judge; the executor side imports nothing of the slot."""
