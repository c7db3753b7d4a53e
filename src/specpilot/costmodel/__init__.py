"""The cost model: hardware ceilings, per-component bytes and FLOPs, measured component times,
and the speedup algebra that ranks the gaps between a deployment and its ceiling.

Modules, one job each:

* ``hardware``   — ceilings measured on the spot, and a datasheet table of GPUs for planning;
* ``shapes``     — model and drafter shapes for on-paper predictions;
* ``accounting`` — bytes, FLOPs and launches per component of a forward; roofline times;
* ``acceptance`` — the per-position acceptance profile and E[tokens/cycle];
* ``components`` — the engine's forward cut into components, as closures over its own pieces;
* ``measure``    — component timings (the engine's pieces, eager or as CUDA-graph replays);
* ``run``        — a real AR-vs-speculative run through ``generate`` (decode only, phase timers);
* ``model``      — predicted / ceiling / measured speedup, prediction error, ranked gaps;
* ``gaps``       — which mechanisms attack which component;
* ``assemble``   — measured parts + accounting → a prediction;
* ``profile_run``— the measured profile of a deployment on the one engine (``specpilot profile``);
* ``bound``      — the most speedup the cost model allows a trial (τ, t_AR, its timed forward);
* ``paper``      — predictions for a GPU from the table, without running anything;
* ``report``     — the terminal table, JSON and the PNG chart (rich and matplotlib, lazily).

See docs/COSTMODEL.md for the formulas.
"""
