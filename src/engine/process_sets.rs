//! The process-set registry: which sets exist, their ranks, and this rank's communicator for each set it
//! belongs to. Ids are assigned identically on every rank because every rank registers and removes sets
//! in the same order: static sets get 1..=k in list order; later sets reuse freed ids in the order they
//! were freed (as Horovod does), else take the next new one.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use crate::engine::communicator::Communicator;

pub struct ProcessSetEntry {
    /// Global ranks, sorted.
    pub ranks: Vec<usize>,
    /// This rank's communicator, if it is a member.
    pub communicator: Option<Arc<Communicator>>,
}

#[derive(Default)]
pub struct ProcessSetRegistry {
    sets: BTreeMap<u32, ProcessSetEntry>,
    freed: VecDeque<u32>,
    next_id: u32,
    /// Registrations so far; names the rendezvous scope of the next one, so a re-added set meets afresh.
    registrations: u64,
}

impl ProcessSetRegistry {
    pub fn get(&self, id: u32) -> Option<&ProcessSetEntry> {
        self.sets.get(&id)
    }

    /// The id a set with these ranks already has.
    pub fn find(&self, ranks: &[usize]) -> Option<u32> {
        self.sets.iter().find(|(_, e)| e.ranks == ranks).map(|(id, _)| *id)
    }

    /// Reserve the id and scope sequence number for the next set.
    pub fn reserve(&mut self) -> (u32, u64) {
        let id = match self.freed.pop_front() {
            Some(id) => id,
            None => {
                let id = self.next_id;
                self.next_id += 1;
                id
            }
        };
        self.registrations += 1;
        (id, self.registrations)
    }

    /// Give back an id reserved by `reserve` whose registration failed: it is the next one handed out.
    pub fn release(&mut self, id: u32) {
        if !self.sets.contains_key(&id) {
            self.freed.push_front(id);
        }
    }

    pub fn insert(&mut self, id: u32, entry: ProcessSetEntry) {
        self.sets.insert(id, entry);
    }

    pub fn remove(&mut self, id: u32) -> Option<ProcessSetEntry> {
        let entry = self.sets.remove(&id)?;
        self.freed.push_back(id);
        Some(entry)
    }

    /// Every set's id and ranks.
    pub fn list(&self) -> Vec<(u32, Vec<usize>)> {
        self.sets.iter().map(|(id, e)| (*id, e.ranks.clone())).collect()
    }

    /// Every communicator this rank has, for shutdown.
    pub fn take_all(&mut self) -> Vec<Arc<Communicator>> {
        std::mem::take(&mut self.sets).into_values().filter_map(|e| e.communicator).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ranks: &[usize]) -> ProcessSetEntry {
        ProcessSetEntry { ranks: ranks.to_vec(), communicator: None }
    }

    #[test]
    fn ids_are_sequential_and_freed_ids_are_reused() {
        let mut r = ProcessSetRegistry::default();
        for ranks in [vec![0, 1], vec![0], vec![1]] {
            let (id, _) = r.reserve();
            r.insert(id, entry(&ranks));
        }
        assert_eq!(r.find(&[0]), Some(1));
        assert!(r.remove(1).is_some());
        assert!(r.remove(1).is_none());
        let (id, seq) = r.reserve();
        assert_eq!((id, seq), (1, 4));
        r.insert(id, entry(&[1, 0]));
        let (id, _) = r.reserve();
        assert_eq!(id, 3);
        assert_eq!(r.list().iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn freed_ids_are_reused_in_the_order_they_were_freed() {
        let mut r = ProcessSetRegistry::default();
        for _ in 0..4 {
            let (id, _) = r.reserve();
            r.insert(id, entry(&[id as usize]));
        }
        r.remove(2);
        r.remove(1);
        assert_eq!(r.reserve().0, 2);
        let (id, _) = r.reserve();
        assert_eq!(id, 1);
        r.release(id);
        assert_eq!(r.reserve().0, 1, "a failed registration's id is handed out next");
        assert_eq!(r.reserve().0, 4);
    }
}
