"""Export the patch set as a stack of pull requests against vllm-omni (and vLLM): ``minicpmo-cg-patch export``.

Usage::

    minicpmo-cg-patch export [--out DIR] [--lane current] [--author 'Name <email>'] [--verify]
                             [--run-tests [--marks EXPR]...] [--gpu-results FILE]...
                             [--checkout VLLM_OMNI_CHECKOUT] [--branch PREFIX] [--pr-number KEY=N]...
                             [--vllm-checkout VLLM_CHECKOUT]

Everything is read from the checkout at export time (:mod:`.changeset`); which patch, owned module,
test file, design-page part and results section goes into which PR is the table of :mod:`.stack`
(page parts tagged in the pages, :mod:`.docsplit`). The pinned vllm-omni release wheel and vllm-omni's
ruff come from PyPI, cached (:mod:`.fetch`). The PRs are committed one after the other in a scratch git
repository on the release (:mod:`.gitseries`, :mod:`.build`), the files rewritten mechanically
(:mod:`.transform`) and formatted by ruff with vllm-omni's settings (:mod:`.lint`, :mod:`.conventions`),
each PR's text assembled from its patches, pages and test runs (:mod:`.prtext`; the runs' logs read by
:mod:`.pytestlog`, a GPU host's by :mod:`.gpuresults`), and :mod:`.verify` checks each PR on its own as
a maintainer would, the earlier PRs' tests included; :mod:`.vllm_main` checks the vLLM PR against
vLLM's ``main``. Edits to files the wheel does not carry (Buildkite,
docs navigation) are in :mod:`.upstream_edits`; an identity no person has (a placeholder address)
is warned about and reported by :mod:`.identity`.
"""
