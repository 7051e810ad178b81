"""The client (asyncio API)."""
