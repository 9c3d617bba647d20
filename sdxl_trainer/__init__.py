"""SDXL full fine-tuning: one module per concern (see README). Importing the package first drops the library
messages nobody here can act on, before any library logs them (library_noise.py)."""

from sdxl_trainer.runtime.quiet_libraries import drop_unactionable_messages

drop_unactionable_messages()
