"""The device check of a GPU machine (device_check.sh) and its parts: sizes, measurements, the wheels it carries."""
