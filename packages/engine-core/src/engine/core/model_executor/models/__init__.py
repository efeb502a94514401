"""Built-in models, registered as ``engine.models`` entry points of engine-core."""
