"""Small shared utilities: the bottom layer, importing nothing else from accel."""
