"""The names of the lowerings and planner modes: the one list each that the rest of
:mod:`keras_cct.lowering` (and the OpenCL kernels, the strategy, the CLI) refer to."""

#: CcT's three lowerings: Type 1 replicates the input (im2col), Type 3 the output (a 1x1 GEMM
#: and a shift-and-add lifting), Type 2 one axis of each.
LOWERED_TYPES = ("type1", "type2", "type3")
#: Every lowering a convolution can be computed by, in the order the planner lists them.
ALL_LOWERINGS = LOWERED_TYPES + ("native", "winograd", "winograd4", "space_to_depth",
                                 "depthwise")
#: What a user may ask for: a lowering, or ``"auto"`` (the planner chooses).
LOWERING_NAMES = ("auto",) + ALL_LOWERINGS
#: How ``"auto"`` chooses (:func:`keras_cct.lowering.choose`).
PLANNER_MODES = ("auto", "model", "measure")
