"""Export the patch set as a pull request against vllm-omni: ``minicpmo-cg-patch export``.

Usage::

    minicpmo-cg-patch export [--out DIR] [--lane current] [--author 'Name <email>'] [--verify]
                             [--run-tests] [--checkout VLLM_OMNI_CHECKOUT [--branch NAME]]

Everything is read from the checkout at export time (:mod:`.changeset`); the pinned vllm-omni
release wheel and vllm-omni's ruff come from PyPI, cached (:mod:`.fetch`). The series is built in
a scratch git repository on the release (:mod:`.gitseries`, :mod:`.build`), the files are
rewritten mechanically (:mod:`.transform`) and formatted by ruff with vllm-omni's settings
(:mod:`.lint`, :mod:`.conventions`), the PR text is assembled from the design and results pages
(:mod:`.prtext`), and :mod:`.verify` checks the result as a maintainer would. Edits to files
the wheel does not carry (Buildkite, docs navigation) are in :mod:`.upstream_edits`.
"""
