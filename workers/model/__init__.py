"""A Llama-shaped decoder over the paged KV pool, with its KV pool and CPU-tier transfers."""
