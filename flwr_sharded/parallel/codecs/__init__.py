"""The code formats of the shard sync's wires: how fp32 values become codes and bytes, and back. One class per codec,
one idea per module:

- `packing`: `CodePacker`, the one packer of 8-, 4- and 2-bit codes into bytes (the first in the low bits), unpacked
  through a codec's table of each byte's code values.
- `base`: `Codec` (any format's values, as a top-k row carries them) and `BlockCodec` (one fp32 scale per block,
  absmax / `qmax`: the quantized wires and their ring, `parallel.ring`).
- `integers` (int8, int4), `floats` (float8 e4m3 and e5m2, float4 e2m1), `levels` (int2): the block codecs.
- `codebook`: the top-k rows' 2-bit codebook, int2's row codec (`Wire.row_codec`).
- `registry`: `CODECS` by name, `codec_of`; `blockwise`: a flat tensor quantized (`Quantized`), its bytes.

A new wire format:
1. Its codec: a subclass of `BlockCodec` in the module of its family (or a new module here), with `bits` (8, 4 or 2)
   and `encode` (scaled values -> packed codes: round, then `self.packer.pack`); a format narrower than a byte also
   `byte_table` (byte -> its codes' values), which the inherited `decode` unpacks through. A format not scaled per
   block (like the codebook) subclasses `Codec` and writes `encode_values` / `decode_values`.
2. An instance of it in `registry.CODECS`, under the wire's name.
3. Its wire: a `register_wire`ed `BlockwiseWire` subclass in `parallel/wire.py` (name, order, bytes per value; a top-k
   row in another codec: `row_codec_name` and `row_side_bytes`).
4. Its test: its rounding bound in `tests/parallel/test_codecs.py` (`rounding_bound`, the dtype list of
   `test_dequantize_is_within_half_a_step_of_the_input`) and its ring case in `tests/parallel/test_ring.py`.
Bytes must never change for an existing codec: the wire format is shared by every rank of every version in a run.
"""
