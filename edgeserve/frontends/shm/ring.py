"""Layout of an edgeserve frame ring: N fixed-size slots in one POSIX shared-memory segment.

The producer (client) creates and owns the segment; the server only maps it through the shared
region registry and never unlinks it. Both sides import this module, so the layout lives here once.

    offset 0   magic         8s   b"ESRING\\x00\\x01"
    offset 8   version       u32  LAYOUT_VERSION
    offset 12  slots         u32  number of slots
    offset 16  slot_size     u64  bytes per slot (a multiple of SLOT_ALIGN)
    offset 24  data_offset   u64  where slot 0 starts (a multiple of PAGE)
    offset 32  gen_offset    u64  where the generation table starts (GEN_OFFSET)
    offset 40  total_size    u64  data_offset + slots * slot_size
    offset 48  reserved      16 bytes of zeros
    offset 64  generation    u64[slots], little-endian, one per slot
    ...        padding up to data_offset
    data_offset + i * slot_size   slot i

All offsets are relative to the start of the registered region. Generation counters are 8-byte
aligned, so each update and read is one machine word on x86-64 and AArch64.

Ownership rule: the producer bumps a slot's generation every time it takes the slot for a new frame
and puts that generation into every reference it sends. The server checks the generation before the
data plane reads the slot, again when the result is in (an input overwritten mid-flight is detected)
and right before and after it writes an output into a slot. Any mismatch fails the request with a
clear error instead of a silently wrong result.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from edgeserve.protocol.errors import invalid_arg

MAGIC = b"ESRING\x00\x01"
LAYOUT_VERSION = 1
HEADER = struct.Struct("<8sIIQQQQ16x")
HEADER_SIZE = HEADER.size  # 64
GEN_OFFSET = HEADER_SIZE
GEN = struct.Struct("<Q")
PAGE = 4096
SLOT_ALIGN = 64
MAX_SLOTS = 65536


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True)
class RingLayout:
    slots: int
    slot_size: int
    data_offset: int
    gen_offset: int = GEN_OFFSET

    @classmethod
    def plan(cls, slots: int, slot_size: int) -> RingLayout:
        """The layout for `slots` slots of at least `slot_size` bytes each."""
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"a ring needs 1..{MAX_SLOTS} slots, got {slots}")
        if slot_size <= 0:
            raise ValueError(f"slot_size must be positive, got {slot_size}")
        data_offset = align_up(GEN_OFFSET + GEN.size * slots, PAGE)
        return cls(slots, align_up(slot_size, SLOT_ALIGN), data_offset)

    @property
    def total_size(self) -> int:
        return self.data_offset + self.slots * self.slot_size

    def header_bytes(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            LAYOUT_VERSION,
            self.slots,
            self.slot_size,
            self.data_offset,
            self.gen_offset,
            self.total_size,
        )

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_size

    def generation_offset(self, slot: int) -> int:
        return self.gen_offset + GEN.size * slot

    @classmethod
    def parse(cls, buffer: memoryview | bytes, region: str, region_size: int | None = None) -> RingLayout:
        """Read and sanity-check a ring header; every failure names the region and what is wrong."""
        if len(buffer) < HEADER_SIZE:
            raise invalid_arg(f"shared memory region '{region}' is too small to hold a ring header")
        magic, version, slots, slot_size, data_offset, gen_offset, total = HEADER.unpack_from(buffer, 0)
        if magic != MAGIC:
            raise invalid_arg(
                f"shared memory region '{region}' is not an edgeserve frame ring (bad magic); slot "
                "references need a ring created by edgeserve.client.FrameRing"
            )
        if version != LAYOUT_VERSION:
            raise invalid_arg(
                f"ring '{region}' has layout version {version}; this server reads version {LAYOUT_VERSION}"
            )
        layout = cls(slots, slot_size, data_offset, gen_offset)
        if (
            not 1 <= slots <= MAX_SLOTS
            or slot_size <= 0
            or gen_offset < HEADER_SIZE
            or gen_offset + GEN.size * slots > data_offset
            or total != layout.total_size
        ):
            raise invalid_arg(f"ring '{region}' has a corrupt header ({slots} slots of {slot_size} bytes)")
        if region_size is not None and layout.total_size > region_size:
            raise invalid_arg(
                f"ring '{region}' declares {layout.total_size} bytes but the region holds {region_size}"
            )
        return layout

    def locate(self, region: str, slot: int, offset: int, byte_size: int) -> int:
        """Region offset of `byte_size` bytes at `offset` inside `slot`, bounds-checked."""
        if not 0 <= slot < self.slots:
            raise invalid_arg(f"slot {slot} is out of range for ring '{region}' ({self.slots} slots)")
        if offset < 0 or byte_size < 0:
            raise invalid_arg(f"ring '{region}' slot {slot}: negative offset or byte size")
        if offset + byte_size > self.slot_size:
            raise invalid_arg(
                f"ring '{region}' slot {slot}: offset {offset} + byte size {byte_size} is past the end of "
                f"the slot ({self.slot_size} bytes)"
            )
        return self.slot_offset(slot) + offset
