"""Importers/exporters between upstream checkpoints (safetensors) and our parameter trees."""
