//! The state a compressed allreduce keeps between steps, per tensor name: the residual of what this rank
//! could not send of its own values (`worker`), of the sums it reduced for the others (`server`, int8 and
//! 1-bit), and PowerSGD's factor Q, warm-started from the last step.
//!
//! It lives as long as the engine's executor: an elastic job's new world starts with none (the engine says
//! how many tensors' state it dropped when it shuts down).

use rustc_hash::FxHashMap;

/// What fills a tensor's state when it has none yet (zeros otherwise).
pub type Init<'a> = Option<&'a dyn Fn(&mut [f32])>;

/// Which kind of state of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// What this rank could not send of its own values.
    Worker,
    /// What this rank could not send of the sums it reduced for the others.
    Server,
    /// PowerSGD's factor Q.
    Factor,
}

/// A tensor's state of one kind, and the compression (its code) that made it.
type States = FxHashMap<String, (u16, Vec<f32>)>;

/// Per-tensor state of compressed allreduces.
#[derive(Default)]
pub struct Feedback {
    worker: States,
    server: States,
    factor: States,
    /// The compression of the op running now (see [`Feedback::begin`]).
    scheme: u16,
    /// Hierarchical: the local rank that carries each tensor across hosts, and how many values each carries.
    owners: FxHashMap<String, usize>,
    carried: Vec<usize>,
    /// The compression (its code) each tensor last ran with, and how many compressed allreduces of it ran
    /// with that one (warm-up steps included).
    steps: FxHashMap<String, (u16, u64)>,
}

impl Feedback {
    /// An op compressed as `compression` (its code) starts: state another compression left for a tensor
    /// is not used (a residual of 1-bit values means nothing to PowerSGD), the tensor starts afresh.
    pub fn begin(&mut self, compression: u16) {
        self.scheme = compression;
    }

    fn map(&mut self, kind: Kind) -> &mut States {
        match kind {
            Kind::Worker => &mut self.worker,
            Kind::Server => &mut self.server,
            Kind::Factor => &mut self.factor,
        }
    }

    /// `name`'s state of `kind`, `len` values: zeros when it has none yet or had another length (its
    /// tensor changed shape), or `init`'s values where given.
    pub fn get(&mut self, kind: Kind, name: &str, len: usize, init: Init<'_>) -> &mut [f32] {
        let scheme = self.scheme;
        let map = self.map(kind);
        let fresh = map.get(name).map_or(true, |(made_by, values)| *made_by != scheme || values.len() != len);
        if fresh {
            let mut values = vec![0.0; len];
            if let Some(init) = init {
                init(&mut values);
            }
            map.insert(name.to_string(), (scheme, values));
        }
        map.get_mut(name).map(|(_, values)| values.as_mut_slice()).unwrap_or_default()
    }

    /// `name`'s state of `kind` if it has one.
    pub fn peek(&self, kind: Kind, name: &str) -> Option<&[f32]> {
        let map = match kind {
            Kind::Worker => &self.worker,
            Kind::Server => &self.server,
            Kind::Factor => &self.factor,
        };
        map.get(name).map(|(_, values)| values.as_slice())
    }

    /// Hierarchical: which of `local_size` local ranks carries tensor `name` (`len` values) across hosts. A
    /// tensor keeps its carrier (and so its residual) for good; a new one goes to the rank carrying least.
    /// Every rank of a host sees the same ops in the same order, so all agree.
    pub fn carrier(&mut self, name: &str, len: usize, local_size: usize) -> usize {
        if self.carried.len() != local_size {
            self.owners.clear();
            self.carried = vec![0; local_size];
        }
        if let Some(&owner) = self.owners.get(name) {
            return owner;
        }
        let owner = (0..local_size).min_by_key(|&i| (self.carried[i], i)).unwrap_or(0);
        if let Some(carried) = self.carried.get_mut(owner) {
            *carried += len;
        }
        self.owners.insert(name.to_string(), owner);
        owner
    }

    /// Count one more step of each of `names`; whether every one of them had run at least `warmup` steps
    /// before (until then an op is reduced exactly). A tensor that last ran with another compression starts
    /// afresh: its state of every kind is dropped (PowerSGD's factor too, which the other compression never
    /// touched) and its warm-up starts again. Every rank runs the same ops, so all agree.
    pub fn step_past_warmup<'n>(&mut self, names: impl IntoIterator<Item = &'n str>, warmup: u64) -> bool {
        let scheme = self.scheme;
        let mut past = true;
        for name in names {
            let known = self.steps.get(name).map(|&(made_by, _)| made_by);
            if known != Some(scheme) {
                if known.is_some() {
                    self.worker.remove(name);
                    self.server.remove(name);
                    self.factor.remove(name);
                }
                self.steps.insert(name.to_string(), (scheme, 0));
            }
            if let Some((_, steps)) = self.steps.get_mut(name) {
                past &= *steps >= warmup;
                *steps += 1;
            }
        }
        past
    }

    /// Number of tensors with any state.
    pub fn tensors(&self) -> usize {
        let mut names: Vec<&String> = self.worker.keys().chain(self.server.keys()).chain(self.factor.keys()).collect();
        names.sort_unstable();
        names.dedup();
        names.len()
    }

    /// Drop every tensor's state.
    pub fn clear(&mut self) {
        self.worker.clear();
        self.server.clear();
        self.factor.clear();
        self.owners.clear();
        self.carried.clear();
        self.steps.clear();
    }
}

impl Drop for Feedback {
    fn drop(&mut self) {
        let tensors = self.tensors();
        if tensors > 0 {
            // When an elastic job's world changes, the new one starts from none: say so.
            tracing::info!("compressed allreduces: dropping the error feedback of {tensors} tensor(s)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_starts_at_zero_or_its_init_and_restarts_when_the_length_changes() {
        let mut feedback = Feedback::default();
        assert_eq!(feedback.get(Kind::Worker, "w", 3, None), [0.0; 3]);
        feedback.get(Kind::Worker, "w", 3, None)[1] = 2.5;
        assert_eq!(feedback.get(Kind::Worker, "w", 3, None), [0.0, 2.5, 0.0], "kept between steps");
        assert_eq!(feedback.get(Kind::Worker, "w", 2, None), [0.0; 2], "a new shape starts again");
        feedback.get(Kind::Worker, "w", 2, None)[0] = 1.0;
        feedback.begin(3);
        assert_eq!(feedback.get(Kind::Worker, "w", 2, None), [0.0; 2], "another compression starts again");
        feedback.begin(0);
        let ones = |v: &mut [f32]| v.fill(1.0);
        assert_eq!(feedback.get(Kind::Factor, "w", 2, Some(&ones)), [1.0; 2]);
        assert_eq!(feedback.tensors(), 1);
        feedback.get(Kind::Server, "b", 1, None);
        assert_eq!(feedback.tensors(), 2);
        feedback.clear();
        assert_eq!(feedback.tensors(), 0);
        // Carriers: balanced by values, and each tensor keeps its own.
        assert_eq!(feedback.carrier("big", 100, 2), 0);
        // Warm-up: exact until every tensor of the op has run `warmup` steps.
        assert!(!feedback.step_past_warmup(["x"], 2));
        assert!(!feedback.step_past_warmup(["x", "y"], 2), "y is new");
        assert!(!feedback.step_past_warmup(["x", "y"], 2), "y has run one step");
        assert!(feedback.step_past_warmup(["x", "y"], 2));
        assert!(feedback.step_past_warmup(["z"], 0));
        // Another compression for a tensor drops all its state, the factor too, and restarts its warm-up.
        feedback.get(Kind::Factor, "x", 2, None).fill(3.0);
        feedback.begin(5);
        assert!(!feedback.step_past_warmup(["x"], 1), "warm-up again");
        assert!(feedback.peek(Kind::Factor, "x").is_none(), "the factor is dropped");
        feedback.begin(0);
        assert!(!feedback.step_past_warmup(["x"], 1), "and again when the first compression comes back");
        assert_eq!(feedback.carrier("small", 10, 2), 1);
        assert_eq!(feedback.carrier("next", 10, 2), 1);
        assert_eq!(feedback.carrier("big", 100, 2), 0);
        assert!(feedback.peek(Kind::Worker, "w").is_none());
    }
}
