"""A distribution whose plugin module cannot be imported."""
