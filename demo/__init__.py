"""The side-by-side chat demo: one Gradio app for both packages (``hatch run chat``).

A tab per package puts the uncompressed cache (left) beside a compressed one (right) on the same
prompt, streaming both replies and measuring each turn; a third tab runs kvbench's protocol on the
user's prompt. The app drives the packages only through their compare harnesses
(:class:`flashcodec.compare.FlashCodecHarness`, :class:`palu_mlx.compare.PaluHarness`), so what it
loads, builds and measures is what ``flashcodec compare`` and ``palu-mlx compare`` do.
"""
