"""Model families (π0.5, GR00T-N1.5) and their parts: SigLIP, multi-expert Gemma, input builders,
tokenizers, and weights/ (upstream checkpoint import/export)."""
