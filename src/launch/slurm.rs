//! Slurm's compressed notations: host lists (`node[01-03,07],gpu5`, as in `SLURM_JOB_NODELIST`) and task
//! counts per node (`2(x3),1`, as in `SLURM_TASKS_PER_NODE`).
//!
//! Ranges keep the zero padding of their first bound (`[08-10]` is `08 09 10`); several bracket groups in
//! one name multiply out (`r[1-2]n[1-2]` is `r1n1 r1n2 r2n1 r2n2`).

/// Longest list expanded, so a hostile value cannot exhaust memory.
const MAX_HOSTS: usize = 1 << 20;

/// Every host of a Slurm host list, in order.
pub fn expand_host_list(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            continue;
        }
        expand_item(item, &mut hosts)?;
    }
    if hosts.is_empty() {
        return Err(format!("host list {list:?} names no host"));
    }
    Ok(hosts)
}

/// The first host of a Slurm host list.
pub fn first_host(list: &str) -> Result<String, String> {
    expand_host_list(list)?.into_iter().next().ok_or_else(|| format!("host list {list:?} names no host"))
}

/// Commas outside brackets separate hosts.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(|| format!("unbalanced ']' in host list {list:?}"))?,
            ',' if depth == 0 => {
                items.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unbalanced '[' in host list {list:?}"));
    }
    items.push(list[start..].trim());
    Ok(items)
}

/// Expands one name with any number of bracket groups into `out`.
fn expand_item(item: &str, out: &mut Vec<String>) -> Result<(), String> {
    let Some(open) = item.find('[') else {
        out.push(item.to_string());
        return Ok(());
    };
    let close = item[open..].find(']').map(|i| open + i).ok_or_else(|| format!("unbalanced '[' in {item:?}"))?;
    let (prefix, body, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    for part in body.split(',') {
        for number in expand_range(part.trim(), item)? {
            expand_item(&format!("{prefix}{number}{rest}"), out)?;
            if out.len() > MAX_HOSTS {
                return Err(format!("host list entry {item:?} expands to more than {MAX_HOSTS} hosts"));
            }
        }
    }
    Ok(())
}

/// `07` -> [07]; `01-03` -> [01, 02, 03] (padded to the width of the first bound).
fn expand_range(part: &str, item: &str) -> Result<Vec<String>, String> {
    let bad = || format!("bad range {part:?} in host list entry {item:?}");
    let (low, high) = part.split_once('-').unwrap_or((part, part));
    let (low_value, high_value) = (low.parse::<u64>().map_err(|_| bad())?, high.parse::<u64>().map_err(|_| bad())?);
    if high_value < low_value || high_value - low_value >= MAX_HOSTS as u64 {
        return Err(bad());
    }
    let width = low.len();
    Ok((low_value..=high_value).map(|n| format!("{n:0width$}")).collect())
}

/// `2(x3),1` -> [2, 2, 2, 1]: how many tasks each node of the step runs.
pub fn expand_tasks_per_node(value: &str) -> Result<Vec<usize>, String> {
    let bad = |part: &str| format!("bad entry {part:?} in tasks-per-node list {value:?}");
    let mut counts = Vec::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (count, repeat) = match part.split_once("(x") {
            Some((count, repeat)) => (count, repeat.strip_suffix(')').ok_or_else(|| bad(part))?),
            None => (part, "1"),
        };
        let count = count.parse::<usize>().map_err(|_| bad(part))?;
        let repeat = repeat.parse::<usize>().map_err(|_| bad(part))?;
        if repeat > MAX_HOSTS - counts.len() {
            return Err(bad(part));
        }
        counts.extend(std::iter::repeat(count).take(repeat));
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists_expand_like_slurm() {
        assert_eq!(expand_host_list("node1").unwrap(), ["node1"]);
        assert_eq!(expand_host_list("node[01-03,07],gpu5").unwrap(), ["node01", "node02", "node03", "node07", "gpu5"]);
        assert_eq!(expand_host_list("n[8-10]").unwrap(), ["n8", "n9", "n10"]);
        assert_eq!(expand_host_list("n[08-10]").unwrap(), ["n08", "n09", "n10"]);
        assert_eq!(expand_host_list("r[1-2]n[1-2]").unwrap(), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(expand_host_list("a-1,b[2]").unwrap(), ["a-1", "b2"]);
        assert_eq!(first_host("cn[100-200]").unwrap(), "cn100");
    }

    #[test]
    fn bad_host_lists_say_what_is_wrong() {
        assert!(expand_host_list("node[1-").unwrap_err().contains("unbalanced"));
        assert!(expand_host_list("node]").unwrap_err().contains("unbalanced"));
        assert!(expand_host_list("node[3-1]").unwrap_err().contains("bad range"));
        assert!(expand_host_list("node[a-b]").unwrap_err().contains("bad range"));
        assert!(expand_host_list("n[0-99999999]").is_err());
        assert!(expand_host_list("").unwrap_err().contains("no host"));
    }

    #[test]
    fn tasks_per_node_expand() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        assert!(expand_tasks_per_node("2(x").is_err());
        assert!(expand_tasks_per_node("x").is_err());
        // A repeat count near usize::MAX is refused, not wrapped past the limit (user input from Slurm's env).
        assert!(expand_tasks_per_node(&format!("2(x{})", usize::MAX)).is_err());
        assert!(expand_tasks_per_node(&format!("1,2(x{})", usize::MAX)).is_err());
    }
}
