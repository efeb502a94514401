"""EngineCore and its one busy loop (the EngineCore process, or a thread under --in-process)."""
