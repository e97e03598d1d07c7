"""End-to-end harnesses: `python -m e2e.local` (the stand-in cluster on loopback) and `e2e/kind/` scripts."""
