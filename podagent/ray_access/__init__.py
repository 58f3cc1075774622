"""Access to Ray: the GCS client and the version gates."""
