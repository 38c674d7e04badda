"""XTuner v1 configs, translated: `standins` runs a config file with recorders in place of the `xtuner.v1`
names it imports (XTuner v1 is not installable from the package registry; a real one is used when
importable), `translate` maps the resulting `trainer = TrainerConfig(...)` onto this trainer's schema and
reports every field it cannot carry. `tools/from_xtuner.py` is the command line.
"""
