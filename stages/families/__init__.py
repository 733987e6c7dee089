"""Model family adapters behind one interface (base.py), listed by registry.py."""
