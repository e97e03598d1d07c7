"""Model implementations on pagoda's layers (Llama family)."""
