"""`pagoda bench serve`: a load generator for OpenAI-compatible servers, and its offline baseline."""
