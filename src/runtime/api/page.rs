//! The live page the control endpoint serves at `GET /`: one self-contained HTML file (inline
//! script drawing SVG, no external scripts, styles or fonts, so it works offline) that polls
//! `GET /history` and draws the training and eval loss, the learning rate and the throughput on
//! one time axis, with membership changes, recoveries and drains marked.
//!
//! Behind `--control-auth all` the page's reads need the operator token: open it as
//! `/#token=TOKEN` (the fragment never leaves the browser) or type the token when the page
//! asks; it is sent as `Authorization: Bearer TOKEN`.

/// The page's HTML.
pub const PAGE: &str = include_str!("page.html");

#[cfg(test)]
mod tests {
    use super::PAGE;

    #[test]
    fn the_page_is_self_contained_and_reads_history() {
        assert!(PAGE.starts_with("<!DOCTYPE html>"));
        assert!(PAGE.contains("fetch(\"/history\""));
        assert!(PAGE.contains("Authorization"));
        // Nothing is loaded from elsewhere: the page must work offline.
        for external in ["<script src", "<link", "@import", "http://", "https://"] {
            let hits: Vec<_> = PAGE.match_indices(external).collect();
            let only_svg_ns = external == "http://"
                && hits.len() == 1
                && PAGE.contains("\"http://www.w3.org/2000/svg\"");
            assert!(hits.is_empty() || only_svg_ns, "the page loads {external}");
        }
    }
}
