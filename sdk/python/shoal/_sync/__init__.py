"""The blocking client."""
