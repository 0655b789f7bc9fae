//! Element types, reduce operations, collective kinds and the names of the collective algorithms shared by
//! every layer.
//!
//! The numeric values of [`ReduceOp`] are Horovod's (`Average=0, Sum=1, Adasum=2, Min=3, Max=4, Product=5`),
//! and [`DataType`] and [`Compression`] codes are stable wire values: they cross the network and the Python
//! boundary.

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    Uint8 = 0,
    Int8 = 1,
    Int16 = 2,
    Int32 = 3,
    Int64 = 4,
    Float16 = 5,
    Bfloat16 = 6,
    Float32 = 7,
    Float64 = 8,
    Bool = 9,
    Uint16 = 10,
}

impl DataType {
    pub const ALL: [DataType; 11] = [
        DataType::Uint8,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Float16,
        DataType::Bfloat16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bool,
        DataType::Uint16,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Uint8 | DataType::Int8 | DataType::Bool => 1,
            DataType::Int16 | DataType::Uint16 | DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Float64 => 8,
        }
    }

    /// The type of a buffer-protocol view: its struct-module `format` (native byte order only) and
    /// `itemsize` in bytes. `None` for anything else.
    pub fn from_struct_format(format: &[u8], itemsize: usize) -> Option<DataType> {
        let code = match format {
            [code] => *code,
            [b'@' | b'=', code] => *code,
            [b'<', code] if cfg!(target_endian = "little") => *code,
            [b'>' | b'!', code] if cfg!(target_endian = "big") => *code,
            _ => return None,
        };
        Some(match (code, itemsize) {
            (b'b' | b'h' | b'i' | b'l' | b'q' | b'n', 1) => DataType::Int8,
            (b'b' | b'h' | b'i' | b'l' | b'q' | b'n', 2) => DataType::Int16,
            (b'b' | b'h' | b'i' | b'l' | b'q' | b'n', 4) => DataType::Int32,
            (b'b' | b'h' | b'i' | b'l' | b'q' | b'n', 8) => DataType::Int64,
            (b'B', 1) => DataType::Uint8,
            (b'B' | b'H' | b'I' | b'L' | b'Q' | b'N', 2) => DataType::Uint16,
            (b'e', 2) => DataType::Float16,
            (b'f', 4) => DataType::Float32,
            (b'd', 8) => DataType::Float64,
            (b'?', 1) => DataType::Bool,
            _ => return None,
        })
    }

    pub fn from_code(code: u8) -> Option<DataType> {
        DataType::ALL.get(code as usize).copied()
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    /// The name users see (NumPy / PyTorch spelling).
    pub fn name(self) -> &'static str {
        match self {
            DataType::Uint8 => "uint8",
            DataType::Int8 => "int8",
            DataType::Int16 => "int16",
            DataType::Int32 => "int32",
            DataType::Int64 => "int64",
            DataType::Float16 => "float16",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float32 => "float32",
            DataType::Float64 => "float64",
            DataType::Bool => "bool",
            DataType::Uint16 => "uint16",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DataType::Float16 | DataType::Bfloat16 | DataType::Float32 | DataType::Float64)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction applied by allreduce and reducescatter. Values are Horovod's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Average = 0,
    Sum = 1,
    Adasum = 2,
    Min = 3,
    Max = 4,
    Product = 5,
}

impl ReduceOp {
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        match code {
            0 => Some(ReduceOp::Average),
            1 => Some(ReduceOp::Sum),
            2 => Some(ReduceOp::Adasum),
            3 => Some(ReduceOp::Min),
            4 => Some(ReduceOp::Max),
            5 => Some(ReduceOp::Product),
            _ => None,
        }
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Average => "Average",
            ReduceOp::Sum => "Sum",
            ReduceOp::Adasum => "Adasum",
            ReduceOp::Min => "Min",
            ReduceOp::Max => "Max",
            ReduceOp::Product => "Product",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How an allreduce's floating-point tensors travel (see `ring::compressed`): as they are, or compressed with
/// error feedback. Every rank of an op must agree on it (a mismatch is an error naming both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Compression {
    #[default]
    None,
    /// Blockwise int8: each block of values sent as bytes with one float32 scale.
    Int8,
    /// Blockwise 1-bit: each value's sign, with one float32 scale (the block's root mean square).
    OneBit,
    /// PowerSGD: each matrix as two rank-`rank` factors, with a warm-started Q.
    PowerSgd { rank: u8 },
}

impl Compression {
    /// The wire and Python code: the kind in the low byte (0 none, 1 int8, 2 onebit, 3 powersgd), PowerSGD's
    /// rank in the high byte.
    pub fn code(self) -> u16 {
        match self {
            Compression::None => 0,
            Compression::Int8 => 1,
            Compression::OneBit => 2,
            Compression::PowerSgd { rank } => 3 | (u16::from(rank) << 8),
        }
    }

    /// The compression `code` stands for, or `None` if it stands for none (a PowerSGD rank must be 1-255).
    pub fn from_code(code: u16) -> Option<Compression> {
        let rank = (code >> 8) as u8;
        match (code & 0xff, rank) {
            (0, 0) => Some(Compression::None),
            (1, 0) => Some(Compression::Int8),
            (2, 0) => Some(Compression::OneBit),
            (3, 1..) => Some(Compression::PowerSgd { rank }),
            _ => None,
        }
    }

    pub fn is_none(self) -> bool {
        self == Compression::None
    }

    /// The kind's name in capitals (the timeline's phase names): "NONE", "INT8", "ONEBIT", "POWERSGD".
    pub fn kind_name(self) -> &'static str {
        match self {
            Compression::None => "NONE",
            Compression::Int8 => "INT8",
            Compression::OneBit => "ONEBIT",
            Compression::PowerSgd { .. } => "POWERSGD",
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Int8 => f.write_str("int8"),
            Compression::OneBit => f.write_str("onebit"),
            Compression::PowerSgd { rank } => write!(f, "powersgd(rank={rank})"),
        }
    }
}

/// The element-wise combination the collective kernels perform. Average is Sum followed by a
/// postscale of 1/n, applied by the engine, so kernels never see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Combine {
    Sum,
    Min,
    Max,
    Product,
}

/// What a request or response asks the engine to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CollectiveKind {
    Allreduce = 0,
    Allgather = 1,
    Broadcast = 2,
    Alltoall = 3,
    Reducescatter = 4,
    Barrier = 5,
    Join = 6,
}

impl CollectiveKind {
    pub fn from_code(code: u8) -> Option<CollectiveKind> {
        match code {
            0 => Some(CollectiveKind::Allreduce),
            1 => Some(CollectiveKind::Allgather),
            2 => Some(CollectiveKind::Broadcast),
            3 => Some(CollectiveKind::Alltoall),
            4 => Some(CollectiveKind::Reducescatter),
            5 => Some(CollectiveKind::Barrier),
            6 => Some(CollectiveKind::Join),
            _ => None,
        }
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::Allreduce => "allreduce",
            CollectiveKind::Allgather => "allgather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Alltoall => "alltoall",
            CollectiveKind::Reducescatter => "reducescatter",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::Join => "join",
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How an allreduce combines the ranks' buffers (chosen by `crate::ring::choice`, or configured).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllreduceAlgorithm {
    /// `log2(n)` exchanges of the whole buffer: fewest steps, most bytes.
    RecursiveDoubling,
    /// Reduce-scatter by recursive halving, then allgather by recursive doubling: `2 log2(n)` steps and
    /// the ring's bytes (ranks beyond the largest power of two fold their buffer onto a partner first).
    Rabenseifner,
    /// Reduce-scatter and allgather around the ring: `2(n - 1)` steps, bandwidth-optimal; on two ranks over
    /// shared memory, the pipelined two-rank exchange (the same schedule, in pieces).
    Ring,
}

/// How an allgather(v) collects the ranks' blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllgatherAlgorithm {
    /// Bruck's algorithm: `ceil(log2 n)` steps, any `n`, blocks of any size.
    Bruck,
    /// `n - 1` steps around the ring, each block written straight into its place.
    Ring,
}

/// How a broadcast spreads the root's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BroadcastAlgorithm {
    /// `ceil(log2 n)` rounds, each a whole-buffer send.
    Tree,
    /// Root -> root+1 -> ... in pipelined chunks: about `S / bandwidth` once the pipeline is full.
    Chain,
}

/// The configured algorithm per collective; `None`: chosen by size and number of ranks (see
/// `crate::ring::choice`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AlgorithmOverrides {
    pub allreduce: Option<AllreduceAlgorithm>,
    pub allgather: Option<AllgatherAlgorithm>,
    pub broadcast: Option<BroadcastAlgorithm>,
}

/// An algorithm's name in knobs, logs and the timeline, and its parsing from a knob's value.
pub trait Named: Sized + Copy + 'static {
    /// Every algorithm of the kind.
    const ALL: &'static [Self];
    fn name(self) -> &'static str;

    /// `auto` (`None`) or one of [`Named::ALL`] by name (case and `-`/`_` ignored); `Err` lists the
    /// accepted values.
    fn parse_choice(value: &str) -> Result<Option<Self>, String> {
        let wanted = value.trim().to_ascii_lowercase().replace('-', "_");
        if wanted == "auto" {
            return Ok(None);
        }
        if let Some(found) = Self::ALL.iter().find(|a| a.name() == wanted) {
            return Ok(Some(*found));
        }
        let names: Vec<&str> = std::iter::once("auto").chain(Self::ALL.iter().map(|a| a.name())).collect();
        Err(format!("expected one of {}", names.join(", ")))
    }
}

impl Named for AllreduceAlgorithm {
    const ALL: &'static [Self] = &[Self::RecursiveDoubling, Self::Rabenseifner, Self::Ring];
    fn name(self) -> &'static str {
        match self {
            Self::RecursiveDoubling => "recursive_doubling",
            Self::Rabenseifner => "rabenseifner",
            Self::Ring => "ring",
        }
    }
}

impl Named for AllgatherAlgorithm {
    const ALL: &'static [Self] = &[Self::Bruck, Self::Ring];
    fn name(self) -> &'static str {
        match self {
            Self::Bruck => "bruck",
            Self::Ring => "ring",
        }
    }
}

impl Named for BroadcastAlgorithm {
    const ALL: &'static [Self] = &[Self::Tree, Self::Chain];
    fn name(self) -> &'static str {
        match self {
            Self::Tree => "tree",
            Self::Chain => "chain",
        }
    }
}

macro_rules! display_by_name {
    ($($kind:ty),*) => {$(
        impl fmt::Display for $kind {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    )*};
}
display_by_name!(AllreduceAlgorithm, AllgatherAlgorithm, BroadcastAlgorithm);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_formats_map_by_kind_and_size() {
        assert_eq!(DataType::from_struct_format(b"f", 4), Some(DataType::Float32));
        assert_eq!(DataType::from_struct_format(b"<d", 8), Some(DataType::Float64));
        assert_eq!(DataType::from_struct_format(b"l", 8), Some(DataType::Int64));
        assert_eq!(DataType::from_struct_format(b"=q", 8), Some(DataType::Int64));
        assert_eq!(DataType::from_struct_format(b"i", 4), Some(DataType::Int32));
        assert_eq!(DataType::from_struct_format(b"@h", 2), Some(DataType::Int16));
        assert_eq!(DataType::from_struct_format(b"b", 1), Some(DataType::Int8));
        assert_eq!(DataType::from_struct_format(b"B", 1), Some(DataType::Uint8));
        assert_eq!(DataType::from_struct_format(b"e", 2), Some(DataType::Float16));
        assert_eq!(DataType::from_struct_format(b"?", 1), Some(DataType::Bool));
        assert_eq!(DataType::from_struct_format(b"H", 2), Some(DataType::Uint16));
        assert_eq!(DataType::from_struct_format(b"=H", 2), Some(DataType::Uint16));
    }

    #[test]
    fn struct_formats_of_foreign_byte_order_or_unsupported_types_are_refused() {
        assert_eq!(DataType::from_struct_format(b">f", 4), None);
        assert_eq!(DataType::from_struct_format(b"Q", 8), None);
        assert_eq!(DataType::from_struct_format(b"Zf", 8), None);
        assert_eq!(DataType::from_struct_format(b"f", 8), None);
        assert_eq!(DataType::from_struct_format(b"T{f:x:}", 4), None);
        assert_eq!(DataType::from_struct_format(b"", 1), None);
    }
}
