"""The pipeline spec: its schema, the stage table, the data contract, reading a spec file safely, the
compiled-spec cache the DAG file uses, the generated reference, and the typed config each step is given.
"""
