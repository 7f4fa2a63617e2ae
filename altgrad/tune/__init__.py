"""The sweep service (SPEC §7): the format grid as Ray Tune trials over `altgrad.train.Trainer`.

- `config`     the sweep YAML as one pydantic model (`SweepConfig`, `LrSearchConfig`)
- `grid`       grid points (format × optimizer × layer precision × seed), dry-run description
- `trainable`  the thin Tune adapter around the Trainer (resources, log, resume, reporting)
- `asha`, `stopper`, `index`, `progress`: the driver-side deciders and bookkeepers, persisted
  in `<experiment>/sweep_state/` through `store`
- `runner`     Ray start-up, new or restored Tuner, signals; `lifecycle` decides new/resume
- `heartbeat`  the driver's liveness in sweep.json, for a resume from another machine
- `cli`, `ablation`, `lr_search`: the entry points behind `sweeps/*.py`
- `trials`     `python -m altgrad trials`: the trial table, from files only
"""
