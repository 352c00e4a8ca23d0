"""The most-used Caffe forks' additions to the wire schema, merged into BVLC's by
:mod:`keras_cct.caffe.io.proto` (same listing format as :mod:`keras_cct.caffe.io._schema`: a
``message`` header that names a message already defined adds fields to it).

Field numbers are the forks' own, so their .prototxt *and* .caffemodel files parse:

* SSD (weiliu89/caffe): ``permute_param = 202``, ``prior_box_param = 203``,
  ``detection_output_param = 204``, ``norm_param = 206`` (``NormalizeParameter``) and their
  messages with SSD's numbers and defaults (PriorBox ``clip`` false, ``flip`` true, ``offset``
  0.5; DetectionOutput ``code_type`` CORNER, ``keep_top_k`` -1; NMS ``nms_threshold`` 0.3).
  ``min_size``/``max_size`` are repeated as in SSD (OpenCV's single values are the same bytes).
* Fast R-CNN (rbgirshick/caffe-fast-rcnn): ``roi_pooling_param = 8266711``.
* ShuffleNet forks: ``shuffle_channel_param = 164``.

Three fork fields clash with BVLC numbers; they get numbers of their own here (a prototxt names
its fields, so text files parse either way; in a *binary* file the clashing number is read as
BVLC's field -- an unknown or odd value that the importer never uses, since a .caffemodel only
gives weights):

* ``interp_param`` (PSPNet/DeepLab: 143, BVLC's ``input_param``) is 2143 here;
* ``upsample_param`` (SegNet: 137, BVLC's ``embed_param``) is 5137 here;
* PoolingParameter's ``ceil_mode`` (forks: bool 13, BVLC's ``round_mode`` enum with the opposite
  meaning: CEIL = 0) is 1013 here; a binary field 13 is read as BVLC's ``round_mode``.
  (The same numbers as Netron's merged schema.)
"""

SCHEMA_FORKS = r"""
message PermuteParameter
  repeated uint32 order = 1
message NormalizeParameter
  optional bool across_spatial = 1 [default = true]
  optional FillerParameter scale_filler = 2
  optional bool channel_shared = 3 [default = true]
  optional float eps = 4 [default = 1e-10]
message PriorBoxParameter
  enum PriorBoxParameter.CodeType
    CORNER = 1
    CENTER_SIZE = 2
    CORNER_SIZE = 3
  repeated float min_size = 1
  repeated float max_size = 2
  repeated float aspect_ratio = 3
  optional bool flip = 4 [default = true]
  optional bool clip = 5 [default = false]
  repeated float variance = 6
  optional uint32 img_size = 7
  optional uint32 img_h = 8
  optional uint32 img_w = 9
  optional float step = 10
  optional float step_h = 11
  optional float step_w = 12
  optional float offset = 13 [default = 0.5]
message NonMaximumSuppressionParameter
  optional float nms_threshold = 1 [default = 0.3]
  optional int32 top_k = 2
  optional float eta = 3 [default = 1.0]
message SaveOutputParameter
  optional string output_directory = 1
  optional string output_name_prefix = 2
  optional string output_format = 3
  optional string label_map_file = 4
  optional string name_size_file = 5
  optional uint32 num_test_image = 6
message DetectionOutputParameter
  optional uint32 num_classes = 1
  optional bool share_location = 2 [default = true]
  optional int32 background_label_id = 3 [default = 0]
  optional NonMaximumSuppressionParameter nms_param = 4
  optional SaveOutputParameter save_output_param = 5
  optional PriorBoxParameter.CodeType code_type = 6 [default = CORNER]
  optional bool variance_encoded_in_target = 8 [default = false]
  optional int32 keep_top_k = 7 [default = -1]
  optional float confidence_threshold = 9
  optional bool visualize = 10 [default = false]
  optional float visualize_threshold = 11
  optional string save_file = 12
message InterpParameter
  optional int32 height = 1 [default = 0]
  optional int32 width = 2 [default = 0]
  optional int32 zoom_factor = 3 [default = 1]
  optional int32 shrink_factor = 4 [default = 1]
  optional int32 pad_beg = 5 [default = 0]
  optional int32 pad_end = 6 [default = 0]
message UpsampleParameter
  optional uint32 scale = 1 [default = 2]
  optional uint32 scale_h = 2
  optional uint32 scale_w = 3
  optional bool pad_out_h = 4 [default = false]
  optional bool pad_out_w = 5 [default = false]
  optional uint32 upsample_h = 6
  optional uint32 upsample_w = 7
message ROIPoolingParameter
  optional uint32 pooled_h = 1 [default = 0]
  optional uint32 pooled_w = 2 [default = 0]
  optional float spatial_scale = 3 [default = 1]
message ShuffleChannelParameter
  optional uint32 group = 1 [default = 1]
message PoolingParameter
  optional bool ceil_mode = 1013 [default = true]
message LayerParameter
  optional ShuffleChannelParameter shuffle_channel_param = 164
  optional PermuteParameter permute_param = 202
  optional PriorBoxParameter prior_box_param = 203
  optional DetectionOutputParameter detection_output_param = 204
  optional NormalizeParameter norm_param = 206
  optional InterpParameter interp_param = 2143
  optional UpsampleParameter upsample_param = 5137
  optional ROIPoolingParameter roi_pooling_param = 8266711
"""
