"""Where stored responses live: store.py defines the StateStore and picks one from a URL (memory, SQLite, Redis)."""
