"""Session stores: which worker owns a session's KV state (in memory, or shared through Redis)."""
