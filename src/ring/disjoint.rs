//! Borrowing one range of a buffer for reading while another, disjoint range is written, as a ring step
//! does when it sends one block and receives into another.

use std::ops::Range;

/// `(&buf[read], &mut buf[write])`, or `None` if either range is out of bounds or they overlap.
/// Empty ranges never overlap anything.
pub(crate) fn read_write_pair(buf: &mut [u8], read: Range<usize>, write: Range<usize>) -> Option<(&[u8], &mut [u8])> {
    let in_bounds = |r: &Range<usize>| r.start <= r.end && r.end <= buf.len();
    if !in_bounds(&read) || !in_bounds(&write) {
        return None;
    }
    if read.is_empty() {
        return Some((&[], &mut buf[write]));
    }
    if write.is_empty() {
        return Some((&buf[read], &mut []));
    }
    if read.end <= write.start {
        let (head, tail) = buf.split_at_mut(write.start);
        Some((&head[read], &mut tail[..write.len()]))
    } else if write.end <= read.start {
        let (head, tail) = buf.split_at_mut(read.start);
        Some((&tail[..read.len()], &mut head[write]))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disjoint_ranges_in_either_order() {
        let mut buf: Vec<u8> = (0..10).collect();
        let (read, write) = read_write_pair(&mut buf, 0..3, 5..9).unwrap();
        assert_eq!(read, &[0, 1, 2]);
        write.fill(0);
        let (read, write) = read_write_pair(&mut buf, 7..10, 1..3).unwrap();
        assert_eq!(read, &[0, 0, 9]);
        assert_eq!(write, &mut [1, 2]);
    }

    #[test]
    fn empty_ranges_are_always_allowed() {
        let mut buf = vec![0u8; 4];
        assert_eq!(read_write_pair(&mut buf, 2..2, 0..4).map(|(r, w)| (r.len(), w.len())), Some((0, 4)));
        assert_eq!(read_write_pair(&mut buf, 0..4, 4..4).map(|(r, w)| (r.len(), w.len())), Some((4, 0)));
    }

    #[test]
    fn overlapping_or_out_of_bounds_ranges_are_refused() {
        let mut buf = vec![0u8; 4];
        assert!(read_write_pair(&mut buf, 0..3, 2..4).is_none());
        assert!(read_write_pair(&mut buf, 0..5, 4..4).is_none());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 3..1;
        assert!(read_write_pair(&mut buf, backwards, 0..1).is_none());
    }
}
