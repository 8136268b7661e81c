"""Development tools, not used by a running pipeline: the local demo, the GCS emulator start-up and
the tiny model the tests and the demo train.
"""
