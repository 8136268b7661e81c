"""Model registries: the one in GCS and the Vertex AI Model Registry mirror."""
