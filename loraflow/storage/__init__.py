"""The GCS hand-off contract, below everything that reads or writes an artifact: object access (gcs),
the bounded JSON reader (json_objects), artifacts with their manifests, checksums and cache keys,
verifying one, checkpoint markers, local path confinement and fault injection. The errors module only.
"""
