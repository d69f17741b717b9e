"""Embedded DSpark runtime (torch): target, drafter, acceptance, scheduler, decode loop, training.

Entry points, imported from their modules:

* :mod:`.loop` - ``Engine`` runs requests (``GenRequest``) under an ``EngineConfig``
  (types in :mod:`.types`), driving one runtime interface (:mod:`.runtime`): the readable
  per-request :mod:`.reference` or the slot-pool :mod:`.batched`; :mod:`.live` holds the
  running requests, :mod:`.step_rows` builds a step's rows, :mod:`.penalties` the
  frequency / presence / repetition penalties; :mod:`.no_spec` - ``run_no_spec``, the
  plain-decoding baseline on either runtime;
* :mod:`.session` - ``load_models`` / ``Models``, ``run_with_companion`` (a compact run and
  its cap-accept companion into the record sinks);
* :mod:`.model` / :mod:`.drafter` - the target and the DSpark drafter;
  :mod:`.weights` - SmolLM2-135M from its GGUF;
* :mod:`.scheduler` - the SPS-argmax verify budget over :mod:`dspark_obs.cost_table`;
* :mod:`.profile` - measured step times, :mod:`.profile_fit` - cost tables fitted to them;
* :mod:`.train` - the drafter recipe, :mod:`.drafter_eval` - its offline quality.

Why no re-exports here: importing any ``dspark_obs.engine.*`` module runs this file, and
several of them (types, scheduler, step records, the profile fit) are torch-free; eager
re-exports would load torch and every engine module for each of them.
"""

__all__: list[str] = []
