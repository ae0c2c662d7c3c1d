// The colour theme: 'auto' follows the system, 'light' and 'dark' are the user's choice.
// Loaded (blocking, tiny) in <head> so the saved theme applies before the first paint.
(() => {
  const KEY = 'stopline.theme';
  const dark = window.matchMedia('(prefers-color-scheme: dark)');

  function saved() {
    try {
      const value = localStorage.getItem(KEY);
      return value === 'light' || value === 'dark' ? value : 'auto';
    } catch {
      return 'auto';
    }
  }

  function apply(choice) {
    const resolved = choice === 'auto' ? (dark.matches ? 'dark' : 'light') : choice;
    const root = document.documentElement;
    root.dataset.theme = resolved;
    root.dataset.themeChoice = choice;
    // The code-highlighting stylesheets follow the page, not only the system.
    const light = document.getElementById('code-light');
    const night = document.getElementById('code-dark');
    if (light && night) {
      light.media = resolved === 'light' ? 'all' : 'not all';
      night.media = resolved === 'dark' ? 'all' : 'not all';
    }
  }

  function set(choice) {
    try {
      if (choice === 'auto') localStorage.removeItem(KEY);
      else localStorage.setItem(KEY, choice);
    } catch { /* storage off: the choice lasts for this page */ }
    apply(choice);
  }

  dark.addEventListener('change', () => apply(saved()));
  apply(saved());
  window.stoplineTheme = { saved, set };
})();
