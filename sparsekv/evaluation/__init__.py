"""Evaluation core: long-context tasks, scoring, fidelity metrics and reports.

Nothing here runs the engine; functions take tokenizers, token ids, logits or generated text.

* :mod:`~sparsekv.evaluation.tasks`: RULER-style task generators by name (``generate``).
* :mod:`~sparsekv.evaluation.scoring`: ``all`` / ``part`` / ``passkey`` scores (0-100).
* :mod:`~sparsekv.evaluation.fidelity`: greedy agreement and KL against the full cache,
  and ``long_texts`` for fidelity runs.
* :mod:`~sparsekv.evaluation.report`: JSON + Markdown + PNG reports with provenance.
"""
