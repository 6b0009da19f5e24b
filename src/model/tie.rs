//! Tied parameters: one parameter that two units use, such as a token embedding that is also
//! the LM head's weight (GPT-2, SmolLM2, Qwen2.5).
//!
//! The shard map owns a tied parameter once, in its *owner* unit (the earlier one). A later
//! *user* unit computes with a *view*: its own parameters followed by the tied ones, in the order
//! of [`Model::ties`]. The runtime keeps a copy of the owner's gathered values from the owner's
//! forward until the user's backward, so both uses see the same values, and adds the user's
//! gradient for the tied parameter into the owner's accumulator. In exact mode both parts are
//! fixed point, so the sum does not depend on the order, the world size or the stage; an owner
//! unit then has two terms per micro-batch, which its scale exponent accounts for
//! ([`Ties::terms`]).
//!
//! Why a copy rather than keeping the owner gathered: the copy is only the tied parameter (the
//! owner may hold more, e.g. position embeddings), and the schedule stays the untied one.

use std::borrow::Cow;
use std::ops::Range;

use super::{Model, UnitSpec};

/// Parameter `param` of unit `owner` is also used by unit `user` (`owner < user`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tie {
    pub owner: usize,
    /// Index into the owner's `UnitSpec::params`.
    pub param: usize,
    pub user: usize,
}

impl Tie {
    /// The tie of a language model whose head (the last unit, after `layers` blocks) uses the
    /// token embedding (parameter 0 of unit 0) as its weight; none when `tied` is false.
    pub fn head_on_embedding(tied: bool, layers: usize) -> Vec<Tie> {
        match tied {
            true => vec![Tie {
                owner: 0,
                param: 0,
                user: layers + 1,
            }],
            false => Vec::new(),
        }
    }
}

/// The ties of a model, checked and resolved to element ranges of the owners' flat buffers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ties {
    ties: Vec<(Tie, Range<usize>)>,
    /// Number of units (the length of [`terms`](Self::terms)).
    units: usize,
}

impl Ties {
    /// The ties `model` declares, checked against its units.
    pub fn of(model: &dyn Model) -> Result<Self, String> {
        Self::resolve(&model.units(), &model.ties())
    }

    /// Checks `ties` against `units`: each owner comes before its user (the owner's forward
    /// runs first and its backward last, which is when the copy and the gradient are needed),
    /// names an existing parameter, and no parameter is tied to the same user twice.
    pub fn resolve(units: &[UnitSpec], ties: &[Tie]) -> Result<Self, String> {
        let mut out = Vec::with_capacity(ties.len());
        for t in ties {
            if t.owner >= t.user || t.user >= units.len() {
                return Err(format!(
                    "tie {t:?}: the owner must be an earlier unit than the user, both below {}",
                    units.len()
                ));
            }
            let spec = &units[t.owner];
            if t.param >= spec.params.len() {
                return Err(format!(
                    "tie {t:?}: unit {} has {} parameters",
                    spec.name,
                    spec.params.len()
                ));
            }
            if out.iter().any(|(o, _): &(Tie, _)| o == t) {
                return Err(format!("tie {t:?} is declared twice"));
            }
            let start: usize = spec.params[..t.param].iter().map(|p| p.numel()).sum();
            out.push((*t, start..start + spec.params[t.param].numel()));
        }
        Ok(Self {
            ties: out,
            units: units.len(),
        })
    }

    /// `(tie index, owner range)` of the parameters `owner` lends to later units.
    pub fn lent_by(&self, owner: usize) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.ties
            .iter()
            .enumerate()
            .filter(move |(_, (t, _))| t.owner == owner)
            .map(|(i, (_, r))| (i, r.clone()))
    }

    /// `(tie index, tie, owner range)` of the parameters `user` borrows, in view order.
    pub fn borrowed_by(
        &self,
        user: usize,
    ) -> impl Iterator<Item = (usize, Tie, Range<usize>)> + '_ {
        self.ties
            .iter()
            .enumerate()
            .filter(move |(_, (t, _))| t.user == user)
            .map(|(i, (t, r))| (i, *t, r.clone()))
    }

    /// Elements `user` borrows (its view is its own length plus this).
    pub fn borrowed_len(&self, user: usize) -> usize {
        self.borrowed_by(user).map(|(_, _, r)| r.len()).sum()
    }

    /// Gradient terms per micro-batch that land on each unit's accumulator: 1, plus one per
    /// use of a parameter it lends (the exact-sum headroom of an owner counts both).
    pub fn terms(&self) -> Vec<u32> {
        let mut t = vec![1u32; self.units];
        for (tie, _) in &self.ties {
            t[tie.owner] += 1;
        }
        t
    }

    /// The buffer `unit` computes with: its own parameters, then the ones it borrows.
    /// `params(u)` gives unit `u`'s full parameters.
    pub fn view<'a>(&self, unit: usize, params: impl Fn(usize) -> &'a [f32]) -> Cow<'a, [f32]> {
        self.view_of(unit, params(unit), |_, t, r| &params(t.owner)[r])
    }

    /// The view of `unit` from its own parameters `own` and `borrowed(tie index, tie, owner
    /// range)`, the values of each parameter it borrows (the owner's, or a copy of them).
    pub fn view_of<'a>(
        &self,
        unit: usize,
        own: &'a [f32],
        borrowed: impl Fn(usize, Tie, Range<usize>) -> &'a [f32],
    ) -> Cow<'a, [f32]> {
        if self.borrowed_len(unit) == 0 {
            return Cow::Borrowed(own);
        }
        let mut v = own.to_vec();
        for (i, t, r) in self.borrowed_by(unit) {
            v.extend_from_slice(borrowed(i, t, r));
        }
        Cow::Owned(v)
    }

    /// The part of a gradient in `unit`'s view layout that belongs to its own parameters.
    pub fn own_grad<'g>(&self, unit: usize, view_grad: &'g [f32]) -> &'g [f32] {
        &view_grad[..view_grad.len() - self.borrowed_len(unit)]
    }

    /// The parts of a gradient in `unit`'s view layout that belong to the parameters it
    /// borrows, each with its tie and owner range, to be added to the owner's gradient.
    pub fn borrowed_grads<'g>(
        &'g self,
        unit: usize,
        view_grad: &'g [f32],
    ) -> impl Iterator<Item = (Tie, Range<usize>, &'g [f32])> + 'g {
        let mut off = self.own_grad(unit, view_grad).len();
        self.borrowed_by(unit).map(move |(_, t, r)| {
            let part = &view_grad[off..off + r.len()];
            off += r.len();
            (t, r, part)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ParamSpec;

    fn units() -> Vec<UnitSpec> {
        let p = |name: &str, n| ParamSpec {
            name: name.into(),
            shape: vec![n],
        };
        vec![
            UnitSpec {
                name: "embed".into(),
                params: vec![p("tok", 6), p("pos", 2)],
            },
            UnitSpec {
                name: "block".into(),
                params: vec![p("w", 3)],
            },
            UnitSpec {
                name: "head".into(),
                params: vec![p("ln", 2)],
            },
        ]
    }

    #[test]
    fn a_tie_resolves_to_the_owners_range_and_counts_two_terms() {
        let ties = Ties::resolve(
            &units(),
            &[Tie {
                owner: 0,
                param: 1,
                user: 2,
            }],
        )
        .unwrap();
        assert_eq!(ties.lent_by(0).collect::<Vec<_>>(), vec![(0, 6..8)]);
        assert_eq!(ties.borrowed_len(2), 2);
        assert_eq!(ties.borrowed_len(1), 0);
        assert_eq!(ties.terms(), vec![2, 1, 1]);
        let bufs = [
            vec![0., 1., 2., 3., 4., 5., 6., 7.],
            vec![8.; 3],
            vec![9., 10.],
        ];
        assert_eq!(&*ties.view(2, |u| &bufs[u]), &[9., 10., 6., 7.]);
        assert!(matches!(ties.view(1, |u| &bufs[u]), Cow::Borrowed(_)));
        let g = [1., 2., 3., 4.];
        assert_eq!(ties.own_grad(2, &g), &[1., 2.]);
        let parts: Vec<_> = ties.borrowed_grads(2, &g).collect();
        assert_eq!(parts.len(), 1);
        assert_eq!((parts[0].1.clone(), parts[0].2), (6..8, &[3., 4.][..]));
    }

    #[test]
    fn a_tie_backwards_or_out_of_range_is_refused() {
        let t = |owner, param, user| Tie { owner, param, user };
        for bad in [t(2, 0, 0), t(0, 0, 0), t(0, 5, 2), t(0, 0, 3)] {
            assert!(Ties::resolve(&units(), &[bad]).is_err(), "{bad:?}");
        }
        assert!(Ties::resolve(&units(), &[t(0, 0, 2), t(0, 0, 2)]).is_err());
    }
}
