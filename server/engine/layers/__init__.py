"""Building blocks of the Llama-family models: norms, rotary embeddings, projections, paged attention."""
