//! What the plan needs of the engine's params: name, dtype, shape and
//! pieces, and nothing about their memory. A [`Registry`] provides it for
//! updates; a list of [`ParamLayout`]s provides it for planning without
//! allocating anything (`wm plan` at scales no machine here could hold).

use crate::pieces::Piece;
use crate::quant::params::QuantRole;
use crate::registry::Registry;
use crate::tensor::DType;

/// One param as the plan sees it (borrowed from whoever describes it).
#[derive(Clone, Copy, Debug)]
pub struct ParamView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    /// At least one piece.
    pub pieces: &'a [Piece],
    /// Described without pieces: all of the global tensor of its name, of
    /// its shape (a longer tensor is a shape mismatch, not one it holds the
    /// start of).
    pub whole: bool,
    /// Quantized from its global tensors, or their scales (read from no
    /// source).
    pub quant: QuantRole,
}

impl ParamView<'_> {
    /// The param's bytes (saturating: an overflowing shape was refused
    /// when the param was described).
    pub fn nbytes(&self) -> u64 {
        self.shape
            .iter()
            .fold(self.dtype.size() as u64, |n, &d| n.saturating_mul(d))
    }
}

/// The engine's params, in index order (`Target::Param(i)` is param `i`).
pub trait Params {
    fn count(&self) -> usize;
    fn param(&self, index: usize) -> ParamView<'_>;
}

impl Params for Registry {
    fn count(&self) -> usize {
        self.len()
    }

    fn param(&self, index: usize) -> ParamView<'_> {
        let p = &self.params()[index];
        ParamView {
            name: &p.name,
            dtype: p.dtype,
            shape: &p.shape,
            pieces: &p.pieces,
            whole: p.is_whole_tensor(),
            quant: p.quant,
        }
    }
}

/// A param described without memory (what `wm plan` reads from a layout).
/// Its pieces are checked like a registration's with
/// [`crate::pieces::check_pieces`] by whoever builds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// At least one piece.
    pub pieces: Vec<Piece>,
    /// See [`ParamView::whole`].
    pub whole: bool,
    /// See [`ParamView::quant`].
    pub quant: QuantRole,
}

impl ParamLayout {
    /// All of global tensor `name`, as a param of that name and shape
    /// (a param registered without pieces).
    pub fn whole(name: &str, dtype: DType, shape: &[u64]) -> ParamLayout {
        ParamLayout {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            pieces: vec![Piece::whole(name, shape)],
            whole: true,
            quant: QuantRole::Plain,
        }
    }
}

impl Params for [ParamLayout] {
    fn count(&self) -> usize {
        self.len()
    }

    fn param(&self, index: usize) -> ParamView<'_> {
        let p = &self[index];
        ParamView {
            name: &p.name,
            dtype: p.dtype,
            shape: &p.shape,
            pieces: &p.pieces,
            whole: p.whole,
            quant: p.quant,
        }
    }
}

impl Params for Vec<ParamLayout> {
    fn count(&self) -> usize {
        self.len()
    }

    fn param(&self, index: usize) -> ParamView<'_> {
        self.as_slice().param(index)
    }
}
