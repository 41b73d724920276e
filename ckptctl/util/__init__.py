"""Utilities every layer may use: errors, wording, progress, interruption, resource limits. No checkpoint knowledge."""
