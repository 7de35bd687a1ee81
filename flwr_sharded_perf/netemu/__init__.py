"""An emulated tiered cluster on one Linux machine (`network`), in fresh namespaces (`isolation`)."""
