"""Adapters that let other libraries' model code call swafactory's attention (optional extras)."""
