//! The fair queue of requests waiting for an upstream slot: round robin across identities
//! within a priority class, weighted turns across the classes.
//!
//! Deficit round robin with every request costing one (a request's cost to the backend is not
//! known before it runs) is plain round robin over the identities with requests waiting: each
//! identity in turn gives up its oldest request, so an identity with one request waits at most
//! one turn of every other waiting identity, however many the heaviest has queued.

use std::collections::{HashMap, VecDeque};

/// A route's class in the queue. Under contention the classes are served in turns of
/// `SHARES` (high, normal, low): the lower classes slow down but are never starved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// Requests each class gets per turn when all three have some waiting.
pub const SHARES: [u32; 3] = [8, 4, 1];

/// One waiting request: its number (to leave the queue by), and whatever the owner of the
/// queue hands it when its turn comes.
#[derive(Debug)]
pub(super) struct Waiter<T> {
    pub id: u64,
    pub item: T,
}

/// One class: identities with requests waiting, in turn order, and their requests.
#[derive(Debug)]
struct Class<T> {
    turns: VecDeque<u128>,
    waiting: HashMap<u128, VecDeque<Waiter<T>>>,
}

impl<T> Default for Class<T> {
    fn default() -> Self {
        Self {
            turns: VecDeque::new(),
            waiting: HashMap::new(),
        }
    }
}

/// Waiting requests by class and identity.
#[derive(Debug)]
pub(super) struct FairQueue<T> {
    classes: [Class<T>; 3],
    /// The class whose turn it is, and what it has left of its share.
    class: usize,
    left: u32,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            classes: Default::default(),
            class: 0,
            left: SHARES[0],
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Requests waiting in each class, in `Priority::ALL` order.
    pub fn by_class(&self) -> [usize; 3] {
        self.classes
            .each_ref()
            .map(|c| c.waiting.values().map(VecDeque::len).sum())
    }

    /// Identities with requests waiting.
    pub fn identities(&self) -> usize {
        self.classes.iter().map(|c| c.turns.len()).sum()
    }

    pub fn push(&mut self, class: Priority, key: u128, waiter: Waiter<T>) {
        let c = &mut self.classes[class as usize];
        let queue = c.waiting.entry(key).or_default();
        if queue.is_empty() {
            c.turns.push_back(key);
        }
        queue.push_back(waiter);
        self.len += 1;
    }

    /// Take request `id` of `key` out of the queue (its client left, or it timed out); `None`
    /// when it is no longer there (its turn came).
    pub fn remove(&mut self, class: Priority, key: u128, id: u64) -> Option<Waiter<T>> {
        let c = &mut self.classes[class as usize];
        let queue = c.waiting.get_mut(&key)?;
        let at = queue.iter().position(|w| w.id == id)?;
        let waiter = queue.remove(at);
        if queue.is_empty() {
            c.waiting.remove(&key);
            c.turns.retain(|k| *k != key);
        }
        self.len -= 1;
        waiter
    }

    /// Requests `key` has waiting in `class`.
    pub fn waiting(&self, class: Priority, key: u128) -> usize {
        self.classes[class as usize]
            .waiting
            .get(&key)
            .map_or(0, VecDeque::len)
    }

    /// Make room in a full queue for a request of an identity with `have` waiting: the newest
    /// request of the identity with the most waiting, if that is more than `have + 1` (so
    /// a heavy identity cannot fill the queue for the others). The lowest class gives first.
    pub fn push_out(&mut self, have: usize) -> Option<Waiter<T>> {
        let mut longest: Option<(usize, usize, u128)> = None;
        for (ci, c) in self.classes.iter().enumerate().rev() {
            for (key, q) in &c.waiting {
                if longest.is_none_or(|(n, _, _)| q.len() > n) {
                    longest = Some((q.len(), ci, *key));
                }
            }
        }
        let (n, ci, key) = longest?;
        if n <= have + 1 {
            return None;
        }
        let c = &mut self.classes[ci];
        let queue = c.waiting.get_mut(&key)?;
        let waiter = queue.pop_back();
        if queue.is_empty() {
            c.waiting.remove(&key);
            c.turns.retain(|k| *k != key);
        }
        self.len -= 1;
        waiter
    }

    /// The next request whose turn it is.
    pub fn pop(&mut self) -> Option<Waiter<T>> {
        if self.len == 0 {
            return None;
        }
        // A class with nothing waiting, or its share used up, passes the turn on.
        while self.left == 0 || self.classes[self.class].turns.is_empty() {
            self.class = (self.class + 1) % SHARES.len();
            self.left = SHARES[self.class];
        }
        self.left -= 1;
        let c = &mut self.classes[self.class];
        let key = c.turns.pop_front()?;
        let queue = c.waiting.get_mut(&key)?;
        let waiter = queue.pop_front();
        if queue.is_empty() {
            c.waiting.remove(&key);
        } else {
            c.turns.push_back(key);
        }
        self.len -= 1;
        waiter
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &mut FairQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop().map(|w| w.item)).collect()
    }

    #[test]
    fn identities_take_turns_whatever_one_has_queued() {
        let mut q = FairQueue::default();
        for id in 0..1000 {
            q.push(Priority::Normal, 1, Waiter { id, item: "heavy" });
        }
        q.push(
            Priority::Normal,
            2,
            Waiter {
                id: 1000,
                item: "light",
            },
        );
        q.push(
            Priority::Normal,
            3,
            Waiter {
                id: 1001,
                item: "other",
            },
        );
        let served = order(&mut q);
        // The light identities' only requests come within the first turn.
        assert_eq!(&served[..3], ["heavy", "light", "other"]);
        assert_eq!(served.len(), 1002);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn a_full_queue_pushes_out_the_heaviest_identity_newest_request() {
        let mut q = FairQueue::default();
        for id in 0..4 {
            q.push(Priority::Normal, 1, Waiter { id, item: "heavy" });
        }
        q.push(
            Priority::Normal,
            2,
            Waiter {
                id: 4,
                item: "light",
            },
        );
        assert_eq!(q.push_out(0).map(|w| w.id), Some(3));
        assert_eq!(q.waiting(Priority::Normal, 1), 3);
        // An identity as heavy as the heaviest pushes nothing out.
        assert!(q.push_out(2).is_none());
    }

    #[test]
    fn a_request_leaves_the_queue_by_its_number() {
        let mut q = FairQueue::default();
        q.push(Priority::Low, 7, Waiter { id: 1, item: "a" });
        q.push(Priority::Low, 7, Waiter { id: 2, item: "b" });
        assert_eq!(q.remove(Priority::Low, 7, 1).map(|w| w.item), Some("a"));
        assert!(q.remove(Priority::Low, 7, 1).is_none());
        assert_eq!(q.remove(Priority::Low, 7, 2).map(|w| w.item), Some("b"));
        assert_eq!((q.len(), q.identities()), (0, 0));
        assert!(q.pop().is_none());
    }

    #[test]
    fn classes_share_turns_and_low_is_never_starved() {
        let mut q = FairQueue::default();
        let mut id = 0u64;
        for (class, item) in [
            (Priority::High, "h"),
            (Priority::Normal, "n"),
            (Priority::Low, "l"),
        ] {
            for _ in 0..100 {
                id += 1;
                q.push(class, u128::from(id), Waiter { id, item });
            }
        }
        let served = order(&mut q);
        let first: String = served[..26].concat();
        assert_eq!(first, "hhhhhhhhnnnnlhhhhhhhhnnnnl");
        // Alone in the queue, a class takes every turn.
        assert!(served[served.len() - 20..].iter().all(|s| *s == "l"));
    }
}
